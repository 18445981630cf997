"""The task families by name: which module draws a slide's layout and renders its pixels.

A family is one module with a layout builder (``width, height, label, seed[, classes]`` -> a frozen layout with
``width``, ``height``, ``label``, ``seed`` and ``structure_boxes()``, and optionally ``sidecar_info()``: more
ground truth for the slide's sidecar) and a renderer (``(layout, x, y, width, height)`` -> the intended
``(height, width, 3)`` uint8 level-0 pixels of that window, the same for any tiling). A new family is a module
plus its name in ``TASKS`` and a branch in :func:`check_task`, :func:`task_class_names` and :func:`task_layout`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from pipeline.synthetic.checker import make_layout, render_region
from pipeline.synthetic.objects import (
    OBJECTS_MAX_CLASSES,
    OBJECTS_MIN_CLASSES,
    check_classes,
    make_objects_layout,
    object_class_names,
    render_objects_region,
)
from pipeline.synthetic.shapes import (
    SHAPES_MAX_CLASSES,
    SHAPES_MIN_CLASSES,
    check_shape_classes,
    make_shapes_layout,
    render_shapes_region,
    shape_class_names,
)

__all__ = ["TASKS", "check_task", "task_class_names", "task_label_symmetry", "task_layout"]

TASKS = ("checker", "objects", "shapes")


def check_task(task: Any, classes: Any) -> tuple[str, int]:
    """Validate a task family name and its number of classes; returns ``(task, classes)``."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if task == "checker":
        if isinstance(classes, bool) or not isinstance(classes, (int, np.integer)) or int(classes) != 2:
            raise ValueError(
                f"classes must be 2 for task 'checker' (binary), got {classes!r}; "
                f"task 'objects' takes {OBJECTS_MIN_CLASSES}..{OBJECTS_MAX_CLASSES}, "
                f"task 'shapes' {SHAPES_MIN_CLASSES}..{SHAPES_MAX_CLASSES}"
            )
        return task, 2
    if task == "shapes":
        return task, check_shape_classes(classes)
    return task, check_classes(classes)


def task_class_names(task: str, classes: int) -> tuple[str, ...] | None:
    """The class names (index -> name) of a multi-class family (its labels.csv holds names, its classes are
    balanced); None for ``checker`` (binary labels 0 / 1)."""
    if task == "objects":
        return object_class_names(classes)
    if task == "shapes":
        return shape_class_names(classes)
    return None


def task_label_symmetry(task: str, classes: int) -> str:
    """The largest group of symmetries of the square (:data:`operators.model_config.SYMMETRIES`) that keeps every
    label of the family ``task`` with ``classes`` classes (checked by :func:`check_task`): what its archive states
    as ``data.label_symmetry``.

    ``checker``: ``dihedral`` (a checkerboard and a flat fill stay what they are under every turn and mirror);
    ``shapes``: ``dihedral`` (every glyph is drawn at a random angle and none is a turn or mirror of another);
    ``objects``: ``flips`` with 2 or 3 classes (horizontal, vertical, checkerboard: a quarter turn swaps the
    first two, a mirror keeps them), ``rot180`` from 4 classes (a mirror turns diagonal stripes antidiagonal)."""
    task, classes = check_task(task, classes)
    if task == "objects":
        return "flips" if classes <= 3 else "rot180"
    return "dihedral"


def task_layout(
    task: str, width: int, height: int, label: int, seed: int, classes: int
) -> tuple[Any, Callable[..., np.ndarray]]:
    """``(layout, renderer)`` of one slide of the family ``task`` (checked by :func:`check_task`); the layout
    builder validates the size, label and seed."""
    if task == "objects":
        return make_objects_layout(width, height, label, seed, classes), render_objects_region
    if task == "shapes":
        return make_shapes_layout(width, height, label, seed, classes), render_shapes_region
    return make_layout(width, height, label, seed), render_region
