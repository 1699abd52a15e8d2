"""The Tandem services and the `tandem` command line."""
