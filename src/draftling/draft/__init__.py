"""Stage 4-5: the draft vocabulary (d2t/t2d) and the EAGLE-3 draft model."""
