"""The tracer's tests, in folders like the tracer's own: capture/ (what a record is made from),
storage/ (how it is written and read back), analysis/ (how dumps are compared and judged), and
here the Dumper, its config and the public face. The shared models and fault makers of this
folder (models.py, fault_zoo.py, ports.py, headroom_runs.py) are importable from every one of
them: pytest puts this conftest's folder on sys.path."""
