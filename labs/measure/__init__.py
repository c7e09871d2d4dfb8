"""Measurement: bytes communicated (ledger), bytes held (memory), time spent (timeline)."""

from labs.measure.ledger import CommLedger, CommRecord
from labs.measure.memory import SavedActivations, state_bytes, tensor_bytes
from labs.measure.timeline import Event, Timeline, idle_fraction, plot_gantt
from labs.measure.timing import StepTimer, step_time, time_steps

__all__ = [
    "CommLedger",
    "CommRecord",
    "Event",
    "SavedActivations",
    "StepTimer",
    "Timeline",
    "idle_fraction",
    "plot_gantt",
    "state_bytes",
    "step_time",
    "tensor_bytes",
    "time_steps",
]
