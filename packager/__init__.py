"""The packager (workstation side): import, optimise, quantize, plan, write bundles."""
