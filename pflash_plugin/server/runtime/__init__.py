"""What the routes serve with: the served models and their parts (engine, prompts, calibration),
assembled from settings at start, and the context the routes find on their app."""
