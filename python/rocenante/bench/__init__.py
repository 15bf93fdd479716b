"""`python -m rocenante.bench`: rocenante against the other all-reduces, measured side by side in one run."""
