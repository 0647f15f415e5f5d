"""The host side of a wafer backend: the host program (`program.py`: upload, steps, memcpy only) and
the compile driver (`compile.py`: the generated sources and the cslc command, or the CSL executor)."""
