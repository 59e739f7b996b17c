"""The helpers of the Fashion-MNIST training job, one module per concern; `main.py` beside this package is the
runbook that uses them. docs/design.md has the table of modules. Importing any of them starts nothing: no
MindSpore context, no logging set-up, no download."""
