"""In-memory engines: real, usable products for tests, demos and dry runs.

- RecordingEngine: stores exactly the tensors a refit sends, records every call, transactional.
- RebindingEngine: a RecordingEngine that (wrongly) rebinds its live tensors on commit; the
  service's storage check must catch it.
- ScriptedFaultyEngine: wraps any engine and fails at bucket K, at finalize or at verification.
"""

from adapters.memory.faulty import ScriptedFaultyEngine
from adapters.memory.recording import RebindingEngine, RecordingEngine

__all__ = ["RebindingEngine", "RecordingEngine", "ScriptedFaultyEngine"]
