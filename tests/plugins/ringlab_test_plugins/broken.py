"""`broken_kernel`: a plugin whose import fails, as one needing a missing package would."""

raise ImportError("ringlab_test_plugins.broken needs the package 'not-installed-anywhere'")
