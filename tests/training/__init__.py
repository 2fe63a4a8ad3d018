"""The zinfjax train loop (zinfjax.training): faults, reliability, the examples."""
