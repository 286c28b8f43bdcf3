"""`prunepipe compare`: reads run folders, judges pruned runs against full ones (equal passes and
equal compute), and writes the table and plots. Evaluates nothing itself."""
