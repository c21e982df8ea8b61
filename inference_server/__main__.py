from inference_server.launch import main

main()
