"""Money: what each call cost, what the gateway saved, spend by key and day, and budgets."""
