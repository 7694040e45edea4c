"""Compile time: an FX group becomes a frozen ``CompiledGroup`` (model bytes, fusions,
layouts, threads, executor, timings), a captured graph a compiled callable and its
record. The tuner times and decides; the disk cache remembers."""
