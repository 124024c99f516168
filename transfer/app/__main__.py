from transfer.app.cli import main

main()
