"""Synthetic whole-slide images in real WSI formats (Aperio SVS, generic pyramidal tiled TIFF), with ground truth.

One module per concept:

- :mod:`pipeline.synthetic.checker`: the ``checker`` task family (and the tissue background every family
  paints on);
- :mod:`pipeline.synthetic.objects`: the ``objects`` task family;
- :mod:`pipeline.synthetic.shapes`: the ``shapes`` task family (the majority of a few distorted glyphs among
  ink scribbles);
- :mod:`pipeline.synthetic.tasks`: the families by name (``task=``), the one place a new family is added;
- :mod:`pipeline.synthetic.tiff`: the writer of one slide (:func:`write_synthetic_slide`);
- :mod:`pipeline.synthetic.archive`: the archive driver behind ``foveate synth`` (:func:`synth_archive`).

The two entry points are re-exported here; everything else is imported from its module.
"""

from pipeline.synthetic.archive import synth_archive
from pipeline.synthetic.tiff import write_synthetic_slide

__all__ = ["synth_archive", "write_synthetic_slide"]
