"""The decoding loop's strategies: how a step's drafts are proposed (chains, trees, context lookups) and accepted."""
