"""What every stage reads: the op table (:mod:`.ops`), activations, the folding algebra,
symbolic shapes, read-only graph questions (:mod:`.analysis`), graph edits (:mod:`.edit`), and large
inline model files read and written without parsing or serialising their weights whole (:mod:`.inline`)."""
