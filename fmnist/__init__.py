"""The helpers of the Fashion-MNIST training job; `main.py` beside this package is the runbook that uses them.

Modules, each one concern; imports run down this list and never up:

    preflight    what run.sh checks before msrun starts (no MindSpore)
    settings     the settings table: flags, environment variables, checks
    fetch        getting the IDX files (no MindSpore)
    data         the dataset: loading, transforms, each rank's shard       <- replace for your own data
    model        the network                                               <- replace for your own network
    device       device choice, oneDNN's ISA cap, CPU cores per worker
    distributed  joining the msrun job, collectives, the stop agreement
    metrics      figures over the whole test set, gathered across ranks
    checkpoints  checkpoints, written in the background, and exact resume from any step
    monitor      the training callback: progress, divergence, stop
    restarts     what each restart cost, for the MLflow run
    serving      the trained model outside training: --predict, MindIR, mlflow models serve
    tracking     the MLflow run
    plots        the PNGs
    common       exit codes, errors, logging, atomic files

Importing any of them starts nothing: no MindSpore context, no logging set-up, no download.
"""
