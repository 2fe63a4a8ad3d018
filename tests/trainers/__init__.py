"""The trainers zinfjax train drives (zinfjax.trainers)."""
