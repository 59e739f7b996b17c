"""The job's modules, one per concern, used by main.py (docs/design.md); importing one starts nothing."""
