"""SIGTERM handling of the commands (:mod:`pipeline.interrupt`): a termination signal whose KeyboardInterrupt a
library swallowed (a garbage-collector callback only prints "Exception ignored in") still ends the command at
its next wait, and ``ray.init``'s own handler does not replace ours."""

from __future__ import annotations

import gc
import os
import signal
import sys
import weakref

import pytest

from pipeline import interrupt


@pytest.fixture
def handler():
    before = signal.getsignal(signal.SIGTERM)
    interrupt._requested.clear()
    assert interrupt.install()
    yield
    signal.signal(signal.SIGTERM, before)
    interrupt._requested.clear()
    interrupt._installed = False


class _Thing:
    pass


def test_a_sigterm_swallowed_by_a_gc_callback_is_raised_again_by_check(handler, monkeypatch):
    assert signal.getsignal(signal.SIGTERM) is interrupt.on_terminate
    interrupt.check()  # nothing arrived: no exception
    seen, dropped = [], []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: dropped.append(repr(u.exc_value)))

    def callback(_ref):  # runs inside the collector: an exception here is printed and dropped
        seen.append(True)
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs at the next bytecode boundary, inside this callback
            pass

    thing = _Thing()
    ref = weakref.ref(thing, callback)
    del thing
    gc.collect()
    assert seen and ref() is None
    assert dropped == ["KeyboardInterrupt('signal 15')"]  # the collector dropped it: nothing raised here
    assert interrupt.requested()
    with pytest.raises(KeyboardInterrupt, match="terminated by a signal"):
        interrupt.check()


def test_a_sigterm_raises_keyboard_interrupt_where_the_main_thread_is(handler):
    with pytest.raises(KeyboardInterrupt, match="signal 15"):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10**6):
            pass
    assert interrupt.requested()


def test_reinstall_puts_our_handler_back_after_another_replaced_it(handler):
    signal.signal(signal.SIGTERM, lambda s, f: None)  # what ray.init does (sys.exit(15))
    interrupt.reinstall()
    assert signal.getsignal(signal.SIGTERM) is interrupt.on_terminate


def test_reinstall_leaves_the_handler_alone_when_install_was_never_called():
    before = signal.getsignal(signal.SIGTERM)
    interrupt._installed = False
    interrupt.reinstall()
    assert signal.getsignal(signal.SIGTERM) is before
