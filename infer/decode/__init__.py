"""The decode cycle: prompt prefill, propose, verify, accept, roll back; one sequence (Engine) or a batch."""
