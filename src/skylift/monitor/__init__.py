"""Watch: metrics, TensorBoard and the live progress view."""

from skylift.monitor.metrics import MetricsLogger
from skylift.monitor.progress import ProgressBar

__all__ = ["MetricsLogger", "ProgressBar"]
