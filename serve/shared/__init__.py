"""What train and eval share with serve: conversation sources, typed hydra configs, the W&B run."""
