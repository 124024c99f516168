from transfer.cli import main

main()
