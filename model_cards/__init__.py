"""Model-card templates of hf_normswap, installed as the package `hf_normswap.model_cards`."""
