"""Example sweeps (YAML), installed as service.examples so `ringlab demo` finds them anywhere."""
