/// Client response to `connection.start`, providing the chosen security mechanism and initial credentials.
