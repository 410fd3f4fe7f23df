"""Where a record is made: module hooks, the op dispatch mode, record names, source lines and
the gradient scaler's skipped steps. `tracer.Dumper` drives these; nothing here writes a file."""
