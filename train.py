from persrag_lightning.cli import main

main()
