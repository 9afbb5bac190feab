"""``group``: several ``spec.process`` entries applied together to each decoder layer."""
