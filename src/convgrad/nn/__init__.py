"""Drop-in conv modules (``modules``), ``patch``/``unpatch`` of an existing model (``patching``), and ``report``
of what a model's convolutions run (``conv_report``).

``convgrad.nn.Conv2d`` *is a* ``torch.nn.Conv2d`` plus ``backend=``; ``patch(model)`` gives an existing model's
convolutions the same behaviour in place, the ``F.conv*d`` calls of its modules' own forwards included.
"""

from convgrad.nn.conv_report import ConvCallReport, ModelReport, report
from convgrad.nn.modules import Conv1d, Conv2d, Conv3d, ConvTranspose1d, ConvTranspose2d, ConvTranspose3d
from convgrad.nn.patching import patch, patched_class, unpatch

__all__ = ["Conv1d", "Conv2d", "Conv3d", "ConvCallReport", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
           "ModelReport", "patch", "patched_class", "report", "unpatch"]
