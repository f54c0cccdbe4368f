"""Deliberately wrong (unscaled, offset) and broken (import fails) ringlab kernel plugins."""
