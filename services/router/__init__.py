"""The router: worker registry, prefix index, placement policies and admission."""
