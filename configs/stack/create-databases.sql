create database mlflow;
create database prefect;
