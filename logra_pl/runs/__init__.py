"""A run's life outside one process: resuming it, finding where its loggers left off, exporting its policy.

``resume.py`` compares a checkpoint's settings with a run's (structural differences refused, the others listed:
:func:`check_resume`) and finds the newest checkpoint (:func:`find_last_checkpoint`, what ``--ckpt_path last``
resumes); ``stores.py`` gives each logger the run it continues (:class:`RunStore`: TensorBoard, W&B, MLflow...);
``export.py`` writes a checkpoint's policy as a Hugging Face folder (:func:`export_checkpoint`, ``logra-pl export``).
"""

from logra_pl.runs.export import ExportError, export_checkpoint, save_policy_folder
from logra_pl.runs.resume import check_resume, find_last_checkpoint
from logra_pl.runs.stores import ResumePoint, RunStore

__all__ = [
    "ExportError",
    "ResumePoint",
    "RunStore",
    "check_resume",
    "export_checkpoint",
    "find_last_checkpoint",
    "save_policy_folder",
]
