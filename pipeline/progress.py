"""Progress reporting: a tqdm bar on a terminal, plain periodic log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time

__all__ = ["Progress"]

log = logging.getLogger(__name__)


class Progress:
    """``with Progress(total, "tiles") as p: p.update(n)``.

    On a TTY shows a tqdm bar; otherwise logs ``desc: done/total`` at most every ``every_s`` seconds
    and once at the end.
    """

    def __init__(
        self, total: int | None, desc: str, *, unit: str = "it", every_s: float = 10.0, enable: bool | None = None
    ):
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.n = 0
        self.postfix: str | None = None  # the last one given, repeated in the log lines
        self._logged: tuple | None = None  # (n, postfix) of the last log line
        self._bar = None
        tty = sys.stderr.isatty() if enable is None else enable
        if tty:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True)
        self._t0 = self._last = time.monotonic()

    def update(self, n: int = 1, postfix: str | None = None) -> None:
        self.n += n
        if postfix:
            self.postfix = postfix
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix_str(postfix, refresh=False)  # shown by this update
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            self._log()

    def set_total(self, total: int) -> None:
        self.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def _log(self) -> None:
        tot = f"/{self.total}" if self.total is not None else ""
        extra = f" ({self.postfix})" if self.postfix else ""
        self._logged = (self.n, self.postfix)
        log.info("%s: %d%s %s in %.1fs%s", self.desc, self.n, tot, self.unit, time.monotonic() - self._t0, extra)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._logged != (self.n, self.postfix):  # the last line, unless it was just logged
            self._log()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
