"""Cross-framework validation: step by step against a framework run from refdl's start
(``exact``), or a framework's own log against a rerun (``results``); the CLI is
``python -m refdl.validate`` (``__main__``)."""
