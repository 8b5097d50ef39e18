"""An OpenAI-compatible endpoint that black-box agents are trained through (`rollout.agent_endpoint`):
book.py holds the episodes, their token-exact sequences and the count-based engine schedule;
server.py the HTTP routes, the server thread and the rollout round."""
