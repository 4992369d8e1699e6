"""One module per task: how a padded batch goes through a model and what comes out."""
