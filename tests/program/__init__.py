"""Programs (zinfjax.program): initialisers and optimizers run one layer at a time."""
