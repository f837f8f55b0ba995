"""The query stage: what a question of the store means (types, labels, steps, limits), and its answer."""
