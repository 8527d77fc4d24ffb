"""What every stage reads: the op table (:mod:`.ops`), activations, the folding algebra,
symbolic shapes, read-only graph questions (:mod:`.analysis`) and graph edits (:mod:`.edit`)."""
