"""The bundled assets (example documents, budget profiles), installed as kvlab.assets."""
