"""What drafters load beside the model: exit adapters and reduced draft vocabularies, checked against it."""
