"""SpecOffload Ray actors: thin wrappers over runtime classes (next issues)."""
