"""Where a record is measured, written and read back: tensor statistics (and the C kernel), the
HDF5 step-file format, the synchronous and asynchronous writers, the rank lock and the reader."""
