"""Developer benches, each run as ``python3 lab/benches/NAME.py`` (or imported as lab.benches.NAME)."""
