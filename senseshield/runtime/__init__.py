"""The fleet runtime: what the three services run on.

``transport`` (the MQTT link: TLS, credentials, chunking, retained re-publication),
``protocol`` (frames and the typed messages, each defined once), ``service`` (the event
loop every role shares), ``broker`` (the embedded amqtt broker and a Mosquitto child
process) and ``fleet`` (``senseshield fleet up``: a whole fleet as OS processes here).
"""
