"""Where things run (placement from the config) and how weights travel back to the actors."""
