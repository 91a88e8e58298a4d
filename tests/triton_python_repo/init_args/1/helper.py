def describe(args):
    return f"instance {args['model_instance_name']} of {args['model_name']} initialized"
