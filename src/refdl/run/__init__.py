"""One run: build it (``build``), walk its steps (``trajectory``), train with logs,
evaluation and checkpoints (``loop``), report it (``report``), save and restore it
(``checkpoint``)."""
