"""Deliberately wrong (unscaled) and broken (import fails) ringlab kernel plugins."""
