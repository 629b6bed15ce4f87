"""Tools that build models: the stdlib corpus, the bundled pair, a trained draft for any target."""
